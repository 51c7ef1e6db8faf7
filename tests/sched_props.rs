//! Property tests of the scheduler's invariants, driven without a model: random arrivals,
//! aborts and output lengths against a small KV pool (and, for a model with recurrent layers,
//! a small pool of per-sequence states).

use detspec::kv::{BlockTable, PageAllocator, SequenceStates, SimpleAllocator, StatePool};
use detspec::sched::{CachedPrefix, Scheduler, SchedulerLimits, Sequence};
use detspec::SamplingParams;
use proptest::prelude::*;

fn seq(id: u64, prompt_len: usize, max_tokens: usize, deterministic: bool) -> Sequence {
    Sequence {
        id,
        request_id: format!("r{id}"),
        completion_index: 0,
        prompt: (0..prompt_len as u32).collect(),
        output: Vec::new(),
        logprobs: Vec::new(),
        params: SamplingParams {
            max_tokens,
            ..Default::default()
        },
        seed: 0,
        num_computed: 0,
        block_table: BlockTable::new(),
        finish: None,
        stop_reason: None,
        max_len: prompt_len + max_tokens,
        num_preemptions: 0,
        num_cached_tokens: 0,
        deterministic,
        verified: 0,
        emitted: 0,
        dvr: Default::default(),
        constraint: None,
        lora: None,
        cache_salt: 0,
        states: None,
        shared_prefix: 0,
    }
}

/// The examples' scheduler: up to 8 sequences, pages of 4 tokens.
fn example_scheduler(budget: usize, chunk: usize, isolate: bool, defer: bool) -> Scheduler {
    Scheduler::new(SchedulerLimits {
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        page_size: 4,
        max_prefill_chunk: chunk,
        isolate_deterministic_prefill: isolate,
        defer_shared_prefills: defer,
    })
}

#[derive(Debug, Clone)]
enum Op {
    Arrive {
        prompt_len: usize,
        max_tokens: usize,
    },
    Abort(u64),
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..60, 1usize..30).prop_map(|(p, m)| Op::Arrive { prompt_len: p, max_tokens: m }),
        1 => (0u64..40).prop_map(Op::Abort),
        6 => Just(Op::Step),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn plans_respect_limits_and_everything_completes(
        ops in proptest::collection::vec(op(), 1..120),
        pages in 8usize..40,
        max_num_seqs in 1usize..6,
        budget in 8usize..80,
        chunk in 4usize..64,
        defer_shared_prefills in any::<bool>(),
        state_slots in proptest::option::of(2usize..7),
    ) {
        let page_size = 4;
        let alloc = SimpleAllocator::new(pages);
        // Every prompt here starts with the same page: with deferral on, a prompt waits
        // while another one's prefill runs, and still everything completes.
        let limits = SchedulerLimits { max_num_seqs, max_num_batched_tokens: budget, page_size, max_prefill_chunk: chunk, isolate_deterministic_prefill: true, defer_shared_prefills };
        let mut s = Scheduler::new(limits);
        // A recurrent model's states: a replayed (deterministic) sequence holds two.
        let states = StatePool::new(&[3]);
        states.set_capacity(state_slots.unwrap_or(usize::MAX));
        let mut next = 0u64;
        let mut finished = 0usize;
        let mut failed = 0usize;
        let mut aborted = 0usize;
        let run_step = |s: &mut Scheduler, finished: &mut usize, failed: &mut usize| {
            let plan = s.plan(&alloc, &|_, _| CachedPrefix::default());
            *failed += plan.failed.len();
            prop_assert!(plan.num_tokens() <= budget);
            prop_assert!(s.num_running() <= max_num_seqs);
            let mut seen = std::collections::HashSet::new();
            for iso in &plan.isolated {
                let q = s.get(iso.seq).expect("isolated sequence is running");
                prop_assert!(q.deterministic && iso.start == 0 && iso.len == q.prompt.len(), "isolated = whole prompt");
            }
            let isolated_rows: usize = plan.isolated.iter().map(|e| e.len).sum();
            prop_assert!(plan.isolated.len() <= 1 || isolated_rows <= budget, "isolated prefills within their budget");
            for e in plan.entries.iter().chain(&plan.isolated) {
                prop_assert!(seen.insert(e.seq), "sequence planned twice");
                prop_assert!(e.len >= 1 && (e.len <= chunk || plan.isolated.contains(e)));
                let q = s.get(e.seq).expect("planned sequences are running");
                prop_assert_eq!(e.start, q.num_computed);
                prop_assert!(q.block_table.capacity(page_size) >= e.start + e.len, "pages reserved");
                prop_assert_eq!(e.sample, e.start + e.len == q.len());
            }
            // Pages held by running sequences plus free pages account for the whole pool.
            let held: usize = s.iter().map(|q| q.block_table.pages().len()).sum();
            prop_assert_eq!(held + alloc.num_free(), pages);
            // Running sequences, and only they, hold their states, within the capacity.
            let wanted: usize = s.running().iter().map(|q| 1 + usize::from(q.deterministic)).sum();
            prop_assert_eq!(states.num_held(), if state_slots.is_some() { wanted } else { 0 });
            prop_assert!(states.num_held() <= states.capacity());
            s.mark_computed(&plan);
            for e in plan.entries.iter().chain(&plan.isolated).filter(|e| e.sample) {
                let q = s.get_mut(e.seq).unwrap();
                q.output.push(1);
                q.verified = q.output.len();
                if q.output.len() >= q.params.max_tokens || q.len() >= q.max_len {
                    q.finish = Some(detspec::FinishReason::Length);
                }
            }
            *finished += s.take_finished(&alloc).len();
            Ok(())
        };
        for op in ops {
            match op {
                Op::Arrive { prompt_len, max_tokens } => {
                    // The engine rejects prompts that can never fit; mirror that.
                    if (prompt_len + 1).div_ceil(page_size) <= pages {
                        let deterministic = prompt_len % 3 == 0;
                        let mut q = seq(next, prompt_len, max_tokens, deterministic);
                        q.states = state_slots.map(|_| SequenceStates::new(&states, deterministic));
                        s.add(q);
                        next += 1;
                    }
                }
                Op::Abort(id) => {
                    aborted += s.remove_where(&alloc, |q| q.id == id).len();
                }
                Op::Step => run_step(&mut s, &mut finished, &mut failed)?,
            }
        }
        let mut guard = 0;
        while s.has_work() {
            run_step(&mut s, &mut finished, &mut failed)?;
            guard += 1;
            prop_assert!(guard < 20_000, "scheduler made no progress");
        }
        prop_assert_eq!(finished + failed + aborted, next as usize);
        prop_assert_eq!(alloc.num_free(), pages, "every page returned");
        prop_assert_eq!(states.num_held(), 0, "every state returned");
    }
}

/// Deterministic prompts prefill apart from the shared batch, several in one step as long as
/// their rows fit the step's budget (the first one whatever its length), in arrival order.
#[test]
fn isolated_prefills_share_a_step_within_the_budget() {
    let alloc = SimpleAllocator::new(64);
    let mut s = example_scheduler(24, 16, true, false);
    for (id, len) in [(0, 30), (1, 10), (2, 10), (3, 10), (4, 5)] {
        s.add(seq(id, len, 4, true));
    }
    let planned = |s: &mut Scheduler| -> Vec<(u64, usize)> {
        let plan = s.plan(&alloc, &|_, _| CachedPrefix::default());
        s.mark_computed(&plan);
        for e in plan.entries.iter().chain(&plan.isolated) {
            s.get_mut(e.seq)
                .expect("planned sequences run")
                .output
                .push(1);
        }
        plan.isolated.iter().map(|e| (e.seq, e.len)).collect()
    };
    // Over the budget alone: it runs alone. Then two of 10 fit 24, the third waits (and so
    // does the short one behind it: arrival order).
    assert_eq!(planned(&mut s), vec![(0, 30)]);
    assert_eq!(planned(&mut s), vec![(1, 10), (2, 10)]);
    assert_eq!(planned(&mut s), vec![(3, 10), (4, 5)]);
}

/// With a prefix cache, a prompt that starts like one still being prefilled waits for that
/// prefill (the `n` samples of a request), while prompts behind it that start otherwise are
/// admitted; once it is done the waiting ones come in together, reading its pages.
#[test]
fn prompts_sharing_a_prefill_wait_for_it() {
    use std::cell::RefCell;

    let alloc = SimpleAllocator::new(64);
    let mut s = example_scheduler(16, 16, false, true);
    let shared = seq(0, 20, 4, false).prompt;
    // Three samples of one 20-token prompt (two steps of prefill at 16 tokens), then another
    // prompt, and a short one (a page: nothing to share).
    for id in 0..3 {
        s.add(seq(id, 20, 4, false));
    }
    let mut other = seq(9, 6, 4, false);
    other.prompt = vec![7; 6];
    s.add(other);
    s.add(seq(10, 4, 4, false));
    // The prefix cache, as far as the scheduler sees it: the first sample's four full prompt
    // pages once its prefill is done.
    let cache: RefCell<Vec<u32>> = RefCell::new(Vec::new());
    let lookup = |_: &Sequence, tokens: &[u32]| -> CachedPrefix {
        let pages = cache.borrow();
        if pages.is_empty() || tokens.len() < 16 || tokens[..16] != shared[..16] {
            return CachedPrefix::default();
        }
        for &p in pages.iter() {
            alloc.share(p);
        }
        CachedPrefix {
            pages: pages.clone(),
            ..Default::default()
        }
    };
    let planned = |s: &mut Scheduler| -> Vec<(u64, usize)> {
        let plan = s.plan(&alloc, &lookup);
        s.mark_computed(&plan);
        for e in plan.entries.iter().filter(|e| e.sample) {
            s.get_mut(e.seq)
                .expect("planned sequences run")
                .output
                .push(1);
        }
        plan.entries.iter().map(|e| (e.seq, e.len)).collect()
    };
    // The first sample takes the whole budget; its siblings wait.
    assert_eq!(planned(&mut s), vec![(0, 16)]);
    // Its last 4 prompt tokens; the siblings still wait, the other prompts come in.
    assert_eq!(planned(&mut s), vec![(0, 4), (9, 6), (10, 4)]);
    let first = s.get(0).expect("running").block_table.pages()[..4].to_vec();
    *cache.borrow_mut() = first;
    // Done: both siblings come in at once, each computing only its prompt past the pages.
    assert_eq!(
        planned(&mut s),
        vec![(0, 1), (9, 1), (10, 1), (1, 4), (2, 4)]
    );
    assert_eq!(s.get(1).expect("running").num_cached_tokens, 16);
}

/// A prompt that shares only its first page with a long prefill is not held back for it: the
/// wait would save a page, not the prompt.
#[test]
fn a_prompt_sharing_little_with_a_prefill_does_not_wait() {
    let alloc = SimpleAllocator::new(64);
    let mut s = example_scheduler(32, 16, false, true);
    s.add(seq(0, 20, 4, false));
    s.add(seq(1, 20, 4, false)); // a second sample: waits
    let mut little = seq(2, 20, 4, false);
    little.prompt[4..].fill(9); // shares tokens 0..4 only
    s.add(little);
    let plan = s.plan(&alloc, &|_, _| CachedPrefix::default());
    let planned: Vec<(u64, usize)> = plan.entries.iter().map(|e| (e.seq, e.len)).collect();
    assert_eq!(planned, vec![(0, 16), (2, 16)]);
}

/// Chat requests behind a cached system prompt: each computes only its own message, so none
/// waits for another (their shared part is in the cache already), although every one of them
/// shares most of itself with the others.
#[test]
fn prompts_whose_shared_part_is_cached_do_not_wait() {
    let alloc = SimpleAllocator::new(64);
    let mut s = example_scheduler(64, 64, false, true);
    let system: Vec<u32> = (100..116).collect(); // 16 tokens, cached
    for id in 0..3u64 {
        let mut chat = seq(id, 24, 4, false);
        chat.prompt = system
            .iter()
            .copied()
            .chain(id as u32 * 10..id as u32 * 10 + 8)
            .collect();
        s.add(chat);
    }
    let cached: Vec<u32> = (0..4).filter_map(|_| alloc.allocate()).collect();
    let lookup = |_: &Sequence, tokens: &[u32]| -> CachedPrefix {
        if tokens.len() < 16 || tokens[..16] != system[..] {
            return CachedPrefix::default();
        }
        for &p in &cached {
            alloc.share(p);
        }
        CachedPrefix {
            pages: cached.clone(),
            ..Default::default()
        }
    };
    let plan = s.plan(&alloc, &lookup);
    let planned: Vec<(u64, usize)> = plan.entries.iter().map(|e| (e.seq, e.len)).collect();
    assert_eq!(planned, vec![(0, 8), (1, 8), (2, 8)]);
}
