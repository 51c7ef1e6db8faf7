//! Per-sequence text: incremental detokenisation and stop strings, streaming-safe.

use crate::error::Result;
use crate::sampling::SamplingParams;
use crate::tokenizer::{IncrementalDetokenizer, StopChecker, Tokenizer};

/// Detokenizer, accumulated text and stop-string state of one sequence.
pub(crate) struct TextState {
    detok: IncrementalDetokenizer,
    stop: StopChecker,
    /// All text decoded so far (cut at a stop string once one matched).
    text: String,
    /// Bytes of `text` already streamed to the client.
    emitted: usize,
}

/// What one token did to the text.
pub(crate) struct TextUpdate {
    /// Text that may now be streamed (never a prefix of a possible stop string).
    pub delta: String,
    /// The stop string that matched, if any.
    pub stop: Option<String>,
}

impl TextState {
    /// The text state of a sequence of `prompt` under `params` (its stop strings, whether
    /// the text keeps them and special tokens).
    pub fn new(prompt: &[u32], params: &SamplingParams) -> Self {
        Self {
            detok: IncrementalDetokenizer::new(prompt, params.skip_special_tokens),
            stop: StopChecker::new(params.stop.iter().cloned())
                .include_in_output(params.include_stop_str_in_output),
            text: String::new(),
            emitted: 0,
        }
    }

    /// Feeds one generated token; stop strings are only matched when `check_stop` (vLLM does
    /// not stop on them before `min_tokens`).
    pub fn push(&mut self, tok: &Tokenizer, token: u32, check_stop: bool) -> Result<TextUpdate> {
        let delta = self.detok.push(tok, token)?;
        self.text.push_str(&delta);
        let mut stop = None;
        if let Some(m) = self
            .stop
            .check(&self.text, delta.len())
            .filter(|_| check_stop)
        {
            self.text.truncate(m.truncate_at);
            stop = Some(m.stop);
        }
        let safe = if stop.is_some() {
            self.text.len()
        } else {
            self.stop.emittable_len(&self.text)
        };
        Ok(TextUpdate {
            delta: self.take_until(safe),
            stop,
        })
    }

    /// Flushes everything held back (the sequence finished without a stop string).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let tail = self.detok.finish(tok)?;
        self.text.push_str(&tail);
        Ok(self.take_until(self.text.len()))
    }

    fn take_until(&mut self, end: usize) -> String {
        let end = end.max(self.emitted).min(self.text.len());
        let out = self
            .text
            .get(self.emitted..end)
            .unwrap_or_default()
            .to_string();
        self.emitted = end;
        out
    }
}
