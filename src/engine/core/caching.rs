//! What a step leaves in the prefix cache: the prompt pages of sequences whose prefill
//! completed, and the answer pages of sequences that finished, each as the class the
//! determinism policy gives them.

use crate::sched::StepPlan;

use super::EngineCore;

impl EngineCore {
    /// Registers the full prompt pages of sequences whose prefill completed this step in the
    /// prefix cache. Prompt KV is never rewritten (verification and rollback only touch
    /// positions past the prompt), so sharing it is safe.
    pub(super) fn cache_prompt_pages(&self, plan: &StepPlan) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let ps = self.cfg.page_size;
        for e in plan.entries.iter().chain(&plan.isolated) {
            let Some(seq) = self.sched.get(e.seq) else {
                continue;
            };
            let l = seq.prompt.len();
            if e.start < l && e.start + e.len >= l {
                let full = l / ps;
                if let Some(pages) = seq.block_table.pages().get(..full) {
                    let class = self.policy.page_class(seq);
                    self.alloc.insert_prefix_of(
                        &seq.prompt[..full * ps],
                        pages,
                        class,
                        seq.cache_namespace(),
                    );
                }
            }
        }
    }

    /// Registers the full pages of finished sequences' committed output in the prefix cache,
    /// after their prompt pages, so the next turn of a conversation (prompt + answer + new
    /// message; an agent's rollout after a tool call) reads the answer instead of computing it
    /// again. Only positions whose KV is final count: those before the last committed token
    /// (its own KV may be missing, or a rejected guess's). The class is the policy's: where a
    /// deterministic answer's KV is what a prefill of the same tokens writes, `Invariant`.
    pub(super) fn cache_output_pages(&self) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let ps = self.cfg.page_size;
        for seq in self.sched.running().iter().filter(|s| s.is_done()) {
            let final_kv = (seq.prompt.len() + seq.verified)
                .saturating_sub(1)
                .min(seq.num_computed);
            let full = final_kv / ps;
            if full <= seq.prompt.len() / ps {
                continue; // no page past the prompt's, which were registered after prefill
            }
            let Some(pages) = seq.block_table.pages().get(..full) else {
                continue;
            };
            let tokens: Vec<u32> = seq
                .prompt
                .iter()
                .chain(&seq.output)
                .take(full * ps)
                .copied()
                .collect();
            let class = self.policy.output_page_class(seq);
            self.alloc
                .insert_prefix_of(&tokens, pages, class, seq.cache_namespace());
        }
    }
}
