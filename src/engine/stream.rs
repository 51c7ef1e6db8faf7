//! Output streams: the events the engine thread sends per request, and the accumulator that
//! turns them into vLLM-shaped cumulative [`RequestOutput`] snapshots.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam::channel::{Receiver, RecvTimeoutError};

use crate::error::{DetspecError, Result};
use crate::output::{
    CompletionOutput, FinishReason, RequestMetrics, RequestOutput, StopReason, TokenLogprobs,
};

/// Seconds since the Unix epoch, as vLLM reports times.
pub(crate) fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// What the engine tells a request's consumer.
#[derive(Debug)]
pub enum StreamEvent {
    /// The request was accepted (validated, tokenized).
    Accepted {
        request_id: String,
        prompt: Option<String>,
        prompt_token_ids: Vec<u32>,
        n: usize,
        fingerprint: String,
        arrival_time: f64,
    },
    /// New committed tokens of completion `index`.
    Tokens {
        request_id: String,
        index: usize,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
        text_delta: String,
        finish_reason: Option<FinishReason>,
        stop_reason: Option<StopReason>,
        metrics: RequestMetrics,
    },
    /// The request failed; no more events follow for it.
    Failed {
        request_id: String,
        error: DetspecError,
    },
}

impl StreamEvent {
    pub fn request_id(&self) -> &str {
        match self {
            StreamEvent::Accepted { request_id, .. }
            | StreamEvent::Tokens { request_id, .. }
            | StreamEvent::Failed { request_id, .. } => request_id,
        }
    }
}

/// Folds a request's events into cumulative outputs.
#[derive(Debug, Clone)]
pub struct OutputAccumulator {
    output: RequestOutput,
    n: usize,
    /// Per completion, `(tokens, text bytes)` already handed out by [`Self::take_delta`].
    sent: Vec<(usize, usize)>,
}

impl OutputAccumulator {
    pub fn new(request_id: &str) -> Self {
        Self {
            output: RequestOutput {
                request_id: request_id.to_string(),
                prompt: None,
                prompt_token_ids: Vec::new(),
                outputs: Vec::new(),
                finished: false,
                fingerprint: String::new(),
                metrics: RequestMetrics::default(),
            },
            n: 1,
            sent: Vec::new(),
        }
    }

    /// Applies one event; an error event becomes `Err`.
    pub fn apply(&mut self, ev: StreamEvent) -> Result<()> {
        match ev {
            StreamEvent::Accepted {
                prompt,
                prompt_token_ids,
                n,
                fingerprint,
                arrival_time,
                ..
            } => {
                self.output.prompt = prompt;
                self.output.metrics.num_prompt_tokens = prompt_token_ids.len();
                self.output.prompt_token_ids = prompt_token_ids;
                self.output.fingerprint = fingerprint;
                self.output.metrics.arrival_time = arrival_time;
                self.n = n;
                self.output.outputs = (0..n)
                    .map(|index| CompletionOutput {
                        index,
                        token_ids: Vec::new(),
                        text: String::new(),
                        logprobs: Vec::new(),
                        cumulative_logprob: 0.0,
                        finish_reason: None,
                        stop_reason: None,
                    })
                    .collect();
            }
            StreamEvent::Tokens {
                index,
                token_ids,
                logprobs,
                text_delta,
                finish_reason,
                stop_reason,
                metrics,
                ..
            } => {
                let c = self.output.outputs.get_mut(index).ok_or_else(|| {
                    DetspecError::InvalidRequest {
                        request_id: Some(self.output.request_id.clone()),
                        message: format!("event for completion {index} of {}", self.n),
                    }
                })?;
                c.token_ids.extend(token_ids);
                // Token by token, so the sum's rounding does not depend on how the tokens were
                // grouped into events (one per step inline, a window at a time on replay).
                for l in &logprobs {
                    c.cumulative_logprob += f64::from(l.logprob);
                }
                c.logprobs.extend(logprobs);
                c.text.push_str(&text_delta);
                c.finish_reason = finish_reason;
                c.stop_reason = stop_reason;
                let m = &mut self.output.metrics;
                m.num_output_tokens = self.output.outputs.iter().map(|c| c.token_ids.len()).sum();
                m.first_scheduled_time = m.first_scheduled_time.or(metrics.first_scheduled_time);
                m.first_token_time = m.first_token_time.or(metrics.first_token_time);
                m.num_preemptions = m.num_preemptions.max(metrics.num_preemptions);
                m.num_cached_tokens = m.num_cached_tokens.max(metrics.num_cached_tokens);
                m.num_verify_passes = m.num_verify_passes.max(metrics.num_verify_passes);
                m.num_rollbacks = m.num_rollbacks.max(metrics.num_rollbacks);
                m.num_rolled_back_tokens =
                    m.num_rolled_back_tokens.max(metrics.num_rolled_back_tokens);
                m.num_padded_rows = m.num_padded_rows.max(metrics.num_padded_rows);
                self.output.finished = self
                    .output
                    .outputs
                    .iter()
                    .all(|c| c.finish_reason.is_some());
                if self.output.finished {
                    m.finished_time = metrics.finished_time.or(Some(now()));
                }
            }
            StreamEvent::Failed { error, .. } => return Err(error),
        }
        Ok(())
    }

    pub fn output(&self) -> &RequestOutput {
        &self.output
    }

    /// What arrived since the last call: each completion's new tokens, logprobs and text
    /// (vLLM's `RequestOutputKind.DELTA`); everything else (finish and stop reasons, the
    /// cumulative logprob, metrics) as in [`Self::output`]. Committed output only grows, so
    /// the deltas concatenate to the cumulative output.
    pub fn take_delta(&mut self) -> RequestOutput {
        self.sent.resize(self.output.outputs.len(), (0, 0));
        let outputs = self
            .output
            .outputs
            .iter()
            .zip(self.sent.iter_mut())
            .map(|(c, sent)| {
                let (tokens, text) = *sent;
                *sent = (c.token_ids.len(), c.text.len());
                CompletionOutput {
                    index: c.index,
                    token_ids: c.token_ids[tokens..].to_vec(),
                    text: c.text[text..].to_string(),
                    logprobs: c.logprobs[tokens..].to_vec(),
                    cumulative_logprob: c.cumulative_logprob,
                    finish_reason: c.finish_reason,
                    stop_reason: c.stop_reason.clone(),
                }
            })
            .collect();
        RequestOutput {
            request_id: self.output.request_id.clone(),
            prompt: self.output.prompt.clone(),
            prompt_token_ids: self.output.prompt_token_ids.clone(),
            outputs,
            finished: self.output.finished,
            fingerprint: self.output.fingerprint.clone(),
            metrics: self.output.metrics.clone(),
        }
    }

    pub fn into_output(self) -> RequestOutput {
        self.output
    }

    pub fn finished(&self) -> bool {
        self.output.finished
    }
}

/// A request's output stream: yields cumulative snapshots, the last one with `finished`.
/// Dropping it does not abort the request; call [`crate::Engine::abort`] for that.
pub struct RequestStream {
    rx: Receiver<StreamEvent>,
    acc: OutputAccumulator,
    done: bool,
}

impl RequestStream {
    pub(crate) fn new(request_id: &str, rx: Receiver<StreamEvent>) -> Self {
        Self {
            rx,
            acc: OutputAccumulator::new(request_id),
            done: false,
        }
    }

    pub fn request_id(&self) -> &str {
        &self.acc.output().request_id
    }

    /// Waits up to `timeout` for the next snapshot; `Ok(None)` on timeout or after the end.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<RequestOutput>> {
        let deadline = std::time::Instant::now() + timeout;
        while !self.done {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(ev) => {
                    if let Some(out) = self.apply(ev) {
                        return out.map(Some);
                    }
                }
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    self.done = true;
                    return Err(DetspecError::EngineStopped);
                }
            }
        }
        Ok(None)
    }

    /// Folds in an event; returns a snapshot unless the event carried no tokens.
    fn apply(&mut self, ev: StreamEvent) -> Option<Result<RequestOutput>> {
        let accepted = matches!(ev, StreamEvent::Accepted { .. });
        let r = self.acc.apply(ev);
        if r.is_err() || self.acc.finished() {
            self.done = true;
        }
        match r {
            Err(e) => Some(Err(e)),
            Ok(()) if accepted => None,
            Ok(()) => Some(Ok(self.acc.output().clone())),
        }
    }

    /// Blocks until the request finishes and returns its final output.
    pub fn wait(mut self) -> Result<RequestOutput> {
        let mut last = None;
        for out in &mut self {
            last = Some(out?);
        }
        last.ok_or(DetspecError::EngineStopped)
    }
}

impl Iterator for RequestStream {
    type Item = Result<RequestOutput>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            match self.rx.recv() {
                Ok(ev) => {
                    if let Some(out) = self.apply(ev) {
                        return Some(out);
                    }
                }
                Err(_) => {
                    self.done = true;
                    return Some(Err(DetspecError::EngineStopped));
                }
            }
        }
        None
    }
}
