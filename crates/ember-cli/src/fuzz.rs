//! Fuzz target of the command line: random argument vectors (every flag of
//! every command, as clap describes them, with hostile values: negative,
//! huge, fractional, empty, unknown names) through the parser, which gives
//! the parsed command or a usage error, never a panic. Run with the other
//! targets by `cargo xtask fuzz` (`cargo test -p ember-cli --bin ember
//! fuzz_`); the harness is ember-model's `tests/fuzzing`.

#[path = "../../ember-model/tests/fuzzing/mod.rs"]
mod fuzzing;

use super::Cli;
use clap::{CommandFactory, Parser};
use fuzzing::hostile;
use proptest::prelude::*;

#[global_allocator]
static ALLOCATOR: fuzzing::Noting = fuzzing::Noting;

/// Every `--long` and `-s` flag of the command and its subcommands, and the
/// subcommands' names.
fn vocabulary() -> Vec<String> {
    fn walk(cmd: &clap::Command, out: &mut Vec<String>) {
        out.push(cmd.get_name().to_string());
        for a in cmd.get_arguments() {
            out.extend(a.get_long().map(|l| format!("--{l}")));
            out.extend(a.get_short().map(|s| format!("-{s}")));
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut out = Vec::new();
    walk(&Cli::command(), &mut out);
    out.extend(["--", "-", "--help", "-h", "--version", "help"].map(String::from));
    out.sort();
    out.dedup();
    out
}

/// Values at the edges of what the flags take.
const VALUES: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "0.5",
    "-0.0",
    "1e309",
    "nan",
    "inf",
    "-inf",
    "4096",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    "",
    " ",
    "int8",
    "int4",
    "q4_k",
    "bf16",
    "fast",
    "exact",
    "1,2,3",
    "128,,512",
    ",",
    "/nonexistent",
    "model.gguf",
    "127.0.0.1:0",
    "[::1]:99999",
    "=",
    "--ctx",
];

#[derive(Clone, Debug)]
enum Token {
    Flag(usize),
    Value(String),
    /// `--flag=value`.
    Joined(usize, String),
}

/// Each command (`""` for the default one) with its flags: the flag and
/// whether it takes a value.
fn commands() -> Vec<(String, Vec<(String, bool)>)> {
    let flags = |c: &clap::Command| -> Vec<(String, bool)> {
        c.get_arguments()
            .filter_map(|a| {
                let name = a.get_long().map(|l| format!("--{l}")).or(a.get_short().map(|s| format!("-{s}")))?;
                Some((name, a.get_action().takes_values()))
            })
            .collect()
    };
    let root = Cli::command();
    let mut out = vec![(String::new(), flags(&root))];
    out.extend(root.get_subcommands().map(|s| (s.get_name().to_string(), flags(s))));
    out
}

#[derive(Clone, Debug)]
enum Argv {
    /// A command and some of its flags, each with a value when it takes one.
    Command(usize, Vec<(usize, String)>),
    /// Any words.
    Words(Vec<Token>),
}

/// `cli` for the parsed arguments; a usage error rendered as clap prints it.
#[test]
fn fuzz_cli() {
    let words = vocabulary();
    let n = words.len();
    let value = prop_oneof![
        3 => prop::sample::select(VALUES).prop_map(String::from),
        1 => hostile::string(),
        1 => (0u64..5000).prop_map(|n| n.to_string()),
    ];
    let token = prop_oneof![
        3 => (0..n).prop_map(Token::Flag),
        2 => value.clone().prop_map(Token::Value),
        1 => ((0..n), value.clone()).prop_map(|(i, v)| Token::Joined(i, v)),
    ];
    let commands = commands();
    let argv = prop_oneof![
        3 => ((0..commands.len()), prop::collection::vec((any::<usize>(), value.clone()), 0..6))
            .prop_map(|(c, flags)| Argv::Command(c, flags)),
        1 => prop::collection::vec(token, 0..8).prop_map(Argv::Words),
    ];
    fuzzing::run("cli", 256, argv, |argv| {
        let args: Vec<String> = match &argv {
            Argv::Command(c, picked) => {
                let (name, flags) = &commands[*c];
                let mut args: Vec<String> = Some(name.clone()).filter(|n| !n.is_empty()).into_iter().collect();
                for (i, v) in picked {
                    let (flag, takes) = &flags[i % flags.len()];
                    args.push(flag.clone());
                    if *takes {
                        args.push(v.clone());
                    }
                }
                args
            }
            Argv::Words(tokens) => tokens
                .iter()
                .map(|t| match t {
                    Token::Flag(i) => words[*i].clone(),
                    Token::Value(v) => v.clone(),
                    Token::Joined(i, v) => format!("{}={v}", words[*i]),
                })
                .collect(),
        };
        match Cli::try_parse_from(std::iter::once("ember".to_string()).chain(args)) {
            Ok(cli) => {
                fuzzing::outcome("parsed");
                let _ = format!("{cli:?}");
            }
            Err(e) => {
                fuzzing::outcome(format!("{:?}", e.kind()));
                let _ = e.render().to_string();
            }
        }
        Ok(())
    });
}

/// clap's own consistency checks of the command's definition (conflicting
/// names, requirements naming no argument): what would otherwise panic at
/// parse time in a debug build.
#[test]
fn cli_definition_is_consistent() {
    Cli::command().debug_assert();
}
