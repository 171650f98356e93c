//! `ember chat`: a multi-turn conversation in the terminal (or from a pipe,
//! one line per turn).
//!
//! Each turn renders the whole conversation with the model's chat template
//! and hands it to [`Session::generate_from`], which keeps the KV cache of
//! everything that did not change and runs only the new tokens. Ctrl-C stops
//! the reply being written (a [`CancelToken`], checked before every forward
//! pass); `/reset` forgets the conversation; `/exit` or end of input leaves.

use crate::runtime::RuntimeArgs;
use crate::sampling::SamplingArgs;
use anyhow::{Context, Result};
use ember_model::{CancelToken, GenerateOptions, Message, Model, Role, Session, StopReason};
use std::io::{BufRead, IsTerminal, Write};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// System message (default: the chat template's own).
    #[arg(long)]
    system: Option<String>,

    /// Maximum tokens per reply.
    #[arg(short = 'n', long, default_value_t = 1024)]
    max_tokens: usize,

    #[command(flatten)]
    sampling: SamplingArgs,

    #[command(flatten)]
    runtime: RuntimeArgs,

    /// Stop a reply when it contains this text (repeatable).
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,

    /// What to do when the next turn would not fit in the context: drop the
    /// oldest turns (keeping the system message), or stop and say so.
    #[arg(long, value_enum, default_value_t = OnFull::Drop)]
    context_full: OnFull,

    /// Print one JSON object per turn instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum OnFull {
    Drop,
    Stop,
}

#[derive(serde::Serialize)]
struct TurnJson<'a> {
    turn: usize,
    text: &'a str,
    ids: &'a [u32],
    /// Tokens of the conversation as rendered for this turn.
    prompt_tokens: usize,
    /// Of those, tokens whose cache was reused from earlier turns.
    reused_tokens: usize,
    /// Of those, tokens run through the model for this turn.
    prefill_tokens: usize,
    dropped_turns: usize,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    stop: &'static str,
}

pub fn run(args: Args) -> Result<()> {
    let (model, dir) = args.runtime.load(true)?;
    // Ctrl-C cancels the reply being generated (the token is reset each turn).
    let cancel = CancelToken::new();
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        stop_strings: args.stop.clone(),
        cancel: Some(cancel.clone()),
        ..GenerateOptions::from_model_with(&model, &args.sampling.overrides())
    };
    options.sampler.validate()?;
    let mut session = model.session();
    let on_interrupt = cancel.clone();
    ctrlc::set_handler(move || on_interrupt.cancel()).context("installing the Ctrl-C handler")?;

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!(
            "ember chat: {} · {} tokens of context · /reset to start over, /exit or Ctrl-D to leave, Ctrl-C stops a reply",
            dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned()),
            session.capacity()
        );
    }
    let base: Vec<Message> = args.system.iter().map(|s| Message::system(s.clone())).collect();
    let mut messages = base.clone();
    let mut turn = 0;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock();
    let mut bytes = Vec::new();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        bytes.clear();
        if lines.read_until(b'\n', &mut bytes)? == 0 {
            break;
        }
        // One line that is not UTF-8 is refused alone; the session goes on.
        let Ok(line) = std::str::from_utf8(&bytes) else {
            eprintln!("(that line is not valid UTF-8 text; it was skipped)");
            continue;
        };
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = base.clone();
                session.reset();
                eprintln!("(conversation forgotten)");
                continue;
            }
            _ => {}
        }
        messages.push(Message::user(input));
        let Some((ids, dropped)) = fit(&model, &session, &mut messages, base.len(), args.context_full)? else {
            continue;
        };
        turn += 1;
        cancel.reset();
        let mut generation = session.generate_from(&ids, options.clone())?;
        let mut reply = String::new();
        let mut reply_ids = Vec::new();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        for token in &mut generation {
            let token = token?;
            reply_ids.push(token.id);
            reply.push_str(&token.text);
            if !args.json {
                out.write_all(token.text.as_bytes())?;
                out.flush()?;
            }
        }
        let stats = generation.stats().clone();
        drop(generation);
        let stop = match stats.stop {
            Some(StopReason::Cancelled) => "interrupted",
            other => other.map_or("none", StopReason::name),
        };
        if args.json {
            let j = TurnJson {
                turn,
                text: &reply,
                ids: &reply_ids,
                prompt_tokens: ids.len(),
                reused_tokens: stats.reused_tokens,
                prefill_tokens: stats.prompt_tokens,
                dropped_turns: dropped,
                prefill_tok_s: stats.prefill_tok_s(),
                decode_tok_s: stats.decode_tok_s(),
                stop,
            };
            writeln!(out, "{}", serde_json::to_string(&j)?)?;
        } else {
            writeln!(out)?;
            eprintln!(
                "[prefill {} new tokens ({} reused), {:.1} tok/s | decode {} tokens, {:.1} tok/s | {} of {} context tokens | stop: {stop}]",
                stats.prompt_tokens,
                stats.reused_tokens,
                stats.prefill_tok_s(),
                stats.decode_tokens,
                stats.decode_tok_s(),
                session.len(),
                session.capacity(),
            );
            if stop == "context_full" {
                match args.context_full {
                    OnFull::Drop => eprintln!("(the context is full: the next turn drops the oldest turns, or /reset)"),
                    OnFull::Stop => {
                        eprintln!("(the context is full: /reset, or run with --context-full drop or a larger --ctx)")
                    }
                }
            }
        }
        messages.push(Message::assistant(reply));
    }
    Ok(())
}

/// Renders the conversation and makes it fit the context: with room for at
/// least a short reply, dropping the oldest turns (after the `keep` leading
/// system messages) when allowed. Returns the token ids and how many turns
/// were dropped, or `None` (after saying why) when the turn cannot be taken.
fn fit(
    model: &Model,
    session: &Session,
    messages: &mut Vec<Message>,
    keep: usize,
    on_full: OnFull,
) -> Result<Option<(Vec<u32>, usize)>> {
    /// Room kept for the reply when deciding whether a turn fits.
    const REPLY_ROOM: usize = 64;
    let room = session.capacity().saturating_sub(REPLY_ROOM.min(session.capacity() / 4));
    let mut dropped = 0;
    let encode = |m: &[Message]| -> Result<Vec<u32>> { Ok(model.encode(&model.chat_prompt(m)?)?) };
    loop {
        let ids = encode(messages)?;
        if ids.len() <= room {
            if dropped > 0 {
                eprintln!("(context full: dropped the {dropped} oldest turn(s) to make room)");
            }
            return Ok(Some((ids, dropped)));
        }
        // Would the new message fit with every earlier turn forgotten? If
        // not, nothing is dropped: dropping would only lose the conversation.
        if dropped == 0 {
            let alone = [&messages[..keep], &messages[messages.len() - 1..]].concat();
            let n = encode(&alone)?.len();
            if n > room {
                eprintln!(
                    "(this message alone is too long: {n} tokens{} do not fit in {room}; raise --ctx or send a shorter one)",
                    if keep > 0 { " with the system prompt" } else { "" }
                );
                messages.pop();
                return Ok(None);
            }
        }
        if on_full == OnFull::Stop {
            eprintln!(
                "(context full: {} tokens do not fit in {room}; run with --context-full drop to forget the oldest turns, or /reset)",
                ids.len()
            );
            messages.pop();
            return Ok(None);
        }
        // The oldest turn after the system messages: a user message and the
        // assistant's reply to it. The new message itself is never dropped
        // (it fits alone, so there is an older turn while this does not fit).
        messages.remove(keep);
        if messages.len() > keep + 1 && messages[keep].role == Role::Assistant {
            messages.remove(keep);
        }
        dropped += 1;
    }
}
