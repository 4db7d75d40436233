//! The detokenizer thread (SGLang's detokenizer manager): engine events in, text deltas out.
//! Text is released only when it is complete UTF-8 ([`text::IncrementalDecoder`]) and cannot
//! be the start of a stop string; a matched stop string ends the choice and is never sent.

use runtime::{Event, FinishReason, Logprobs};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use text::{IncrementalDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

/// A token's log-probability, with the top alternatives, as text.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and theirs.
    pub top: Vec<(String, f32)>,
}

/// What a choice's stream carries.
#[derive(Debug, Clone)]
pub enum Delta {
    /// New text and the tokens it came from.
    Text {
        /// The text.
        text: String,
        /// Number of tokens.
        tokens: usize,
        /// Their log-probabilities, if asked for.
        logprobs: Vec<TokenLogprob>,
    },
    /// The choice ended.
    Done {
        /// `stop`, `length` or `abort`.
        reason: &'static str,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
        /// Prompt tokens served from the cache.
        cached_tokens: usize,
    },
}

/// Deltas of a request's choices, tagged with the choice index.
pub type Out = UnboundedSender<(usize, Delta)>;

enum Msg {
    Open {
        key: u64,
        index: usize,
        stops: Vec<String>,
        prompt_tokens: usize,
        keep_special: bool,
        out: Out,
    },
    Event {
        key: u64,
        event: Event,
    },
    /// The engine dropped the sink (after the last event, or when it refused the request).
    Close {
        key: u64,
    },
}

/// Sends `Close` when the engine drops a choice's sink, so a refused request leaves nothing
/// behind in the detokenizer.
struct CloseOnDrop {
    key: u64,
    tx: Sender<Msg>,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Close { key: self.key });
    }
}

struct Choice {
    index: usize,
    stops: Vec<String>,
    prompt_tokens: usize,
    out: Out,
    dec: IncrementalDecoder,
    held: String,
    tokens: usize,
    pending_tokens: usize,
    logprobs: Vec<TokenLogprob>,
}

/// Handle to the detokenizer thread.
pub struct Detokenizer {
    tx: Sender<Msg>,
    next: AtomicU64,
}

impl Detokenizer {
    /// Starts the thread.
    pub fn spawn(tok: Arc<Tokenizer>) -> Detokenizer {
        let (tx, rx) = channel::<Msg>();
        std::thread::Builder::new()
            .name("detokenizer".into())
            .spawn(move || {
                let mut choices: HashMap<u64, Choice> = HashMap::new();
                for m in rx {
                    match m {
                        Msg::Open { key, index, stops, prompt_tokens, keep_special, out } => {
                            let dec = IncrementalDecoder::new(!keep_special);
                            let c = Choice {
                                index,
                                stops,
                                prompt_tokens,
                                out,
                                dec,
                                held: String::new(),
                                tokens: 0,
                                pending_tokens: 0,
                                logprobs: vec![],
                            };
                            choices.insert(key, c);
                        }
                        Msg::Event { key, event } => {
                            let done = choices.get_mut(&key).is_some_and(|c| c.on(&tok, event));
                            if done {
                                choices.remove(&key);
                            }
                        }
                        Msg::Close { key } => {
                            choices.remove(&key);
                        }
                    }
                }
            })
            .expect("spawn the detokenizer thread");
        Detokenizer { tx, next: AtomicU64::new(0) }
    }

    /// Registers a choice; returns the sink to give the engine for it. `keep_special` keeps
    /// special tokens in its text (a tool dialect's markers may be ones).
    pub fn open(
        &self,
        index: usize,
        stops: Vec<String>,
        prompt_tokens: usize,
        keep_special: bool,
        out: Out,
    ) -> runtime::Sink {
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        let _ = self.tx.send(Msg::Open { key, index, stops, prompt_tokens, keep_special, out });
        let guard = CloseOnDrop { key, tx: self.tx.clone() };
        Box::new(move |event| {
            let _ = guard.tx.send(Msg::Event { key, event });
        })
    }
}

fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

fn render(tok: &Tokenizer, id: u32, lp: Logprobs) -> TokenLogprob {
    TokenLogprob {
        token: token_text(tok, id),
        logprob: lp.token,
        top: lp.top.into_iter().map(|(t, l)| (token_text(tok, t), l)).collect(),
    }
}

/// The longest suffix of `s` that is a proper prefix of a stop string (held back).
fn held_back(s: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|stop| {
            (1..stop.len().min(s.len() + 1))
                .rev()
                .find(|&k| s.is_char_boundary(s.len() - k) && stop.starts_with(&s[s.len() - k..]))
        })
        .max()
        .unwrap_or(0)
}

impl Choice {
    /// Handles one engine event; returns whether the choice is over.
    fn on(&mut self, tok: &Tokenizer, event: Event) -> bool {
        match event {
            Event::Token { id, logprobs } => {
                self.tokens += 1;
                self.pending_tokens += 1;
                self.held += &self.dec.push(tok, id).unwrap_or_default();
                self.logprobs.extend(logprobs.map(|lp| render(tok, id, lp)));
                if self.stop_matched() {
                    return self.done("stop", 0);
                }
                let keep = held_back(&self.held, &self.stops);
                self.send_text(self.held.len() - keep);
                false
            }
            // Only embedding requests get one; a choice is a generation.
            Event::Embedding(_) => false,
            Event::Finished(f) => {
                self.held += &self.dec.flush(tok).unwrap_or_default();
                if self.stop_matched() {
                    return self.done("stop", f.cached_tokens);
                }
                self.send_text(self.held.len());
                let reason = match f.reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Abort => "abort",
                };
                self.done(reason, f.cached_tokens)
            }
        }
    }

    /// Cuts the held text at the first stop string, if one occurs; returns whether one did.
    fn stop_matched(&mut self) -> bool {
        let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() else { return false };
        self.held.truncate(at);
        self.send_text(at);
        true
    }

    fn send_text(&mut self, upto: usize) {
        if upto == 0 && self.pending_tokens == 0 {
            return;
        }
        if upto == 0 && self.logprobs.is_empty() {
            return;
        }
        let text: String = self.held.drain(..upto).collect();
        let d = Delta::Text { text, tokens: self.pending_tokens, logprobs: std::mem::take(&mut self.logprobs) };
        self.pending_tokens = 0;
        let _ = self.out.send((self.index, d));
    }

    fn done(&mut self, reason: &'static str, cached_tokens: usize) -> bool {
        let d =
            Delta::Done { reason, prompt_tokens: self.prompt_tokens, completion_tokens: self.tokens, cached_tokens };
        let _ = self.out.send((self.index, d));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_stop_prefixes() {
        let stops = vec!["\n\nUser:".to_string(), "END".to_string()];
        assert_eq!(held_back("hello\n\nUs", &stops), 4);
        assert_eq!(held_back("hello E", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(held_back("héllo EN", &stops), 2);
    }
}
