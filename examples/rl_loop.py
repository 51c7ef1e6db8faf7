"""A tiny policy-gradient loop on detspec: deterministic rollouts, exact scoring, a torch
optimizer step, and the new weights pushed back into the engine.

What it shows, at every step:
  * the sampler's logprobs (from generation) equal the scorer's (``llm.score``) bit for bit,
    so the "old logprobs" of the policy-gradient ratio are exactly the sampler's;
  * the engine runs on the weights the trainer just produced (``update_weights``; the
    fingerprint moves with them);
  * the whole run is reproducible: the closing digest (token ids, logprob bits, losses) is
    the same every time the script runs (``--check-rerun`` runs it twice and compares).

    python examples/rl_loop.py                   # the built-in default model
    python examples/rl_loop.py --model DIR --steps 3 --check-rerun
"""

from __future__ import annotations

import argparse
import hashlib
import struct

import torch
import transformers

import detspec
from detspec import SamplingParams


def f32_bits(xs: list[float]) -> bytes:
    return struct.pack(f"<{len(xs)}f", *xs)


def reward(token_ids: list[int], vocab_size: int) -> float:
    """A toy reward the policy can learn quickly: the share of tokens in the lower half of the
    vocabulary."""
    return sum(t < vocab_size // 2 for t in token_ids) / max(len(token_ids), 1)


def run(model_dir: str, steps: int, group: int, max_tokens: int, lr: float) -> str:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.train()
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    vocab = policy.config.vocab_size
    # Start the engine from the trainer's exact weights (the checkpoint may be bf16).
    llm = detspec.LLM(model_dir, determinism="dvr")
    llm.update_weights(policy.state_dict().items())
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (5, 9, 13)]
    digest = hashlib.sha256()

    for step in range(steps):
        # 1. Rollouts: deterministic, seeded, with the sampled tokens' logprobs.
        batch_prompts, params = [], []
        for pi, p in enumerate(prompts):
            for g in range(group):
                batch_prompts.append(p)
                params.append(
                    SamplingParams(
                        temperature=0.8,
                        seed=10_000 * step + 100 * pi + g,
                        max_tokens=max_tokens,
                        ignore_eos=True,
                        deterministic=True,
                    )
                )
        outs = llm.generate(batch_prompts, params, use_tqdm=False)
        completions = [o.outputs[0].token_ids for o in outs]
        sampler_lps = [o.outputs[0].token_logprobs for o in outs]

        # 2. Old logprobs from the scorer: equal to the sampler's, bit for bit.
        scorer_lps = llm.score(batch_prompts, completions, deterministic=True)
        exact = all(
            f32_bits(a) == f32_bits(b) for a, b in zip(sampler_lps, scorer_lps, strict=True)
        )
        n_tokens = sum(len(c) for c in completions)

        # 3. REINFORCE with a per-prompt baseline, on the trainer's own forward.
        rewards = torch.tensor([reward(c, vocab) for c in completions])
        baseline = rewards.view(len(prompts), group).mean(1, keepdim=True)
        advantages = (rewards.view(len(prompts), group) - baseline).flatten()
        optimizer.zero_grad()
        loss = torch.zeros(())
        drift = 0.0
        for p, c, adv, old in zip(batch_prompts, completions, advantages, scorer_lps, strict=True):
            ids = torch.tensor([p + c])
            logits = policy(ids).logits[0, len(p) - 1 : -1]
            lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c)[:, None])[:, 0]
            drift = max(drift, (lp.detach() - torch.tensor(old)).abs().max().item())
            loss = loss - adv * lp.sum() / len(batch_prompts)
        loss.backward()
        optimizer.step()

        # 4. Push the new weights into the engine (between its steps; prefix cache dropped).
        llm.update_weights(policy.state_dict().items())

        print(
            f"step {step}: reward {rewards.mean():.4f}  loss {loss.item():+.6f}  "
            f"sampler == scorer: {exact} ({n_tokens} tokens)  "
            f"max |torch - detspec| logprob {drift:.2e}  "
            f"weights v{llm.weight_version} {llm.fingerprint}"
        )
        if not exact:
            raise SystemExit("sampler and scorer logprobs differ: the contract is broken")
        for c, lps in zip(completions, sampler_lps, strict=True):
            digest.update(struct.pack(f"<{len(c)}I", *c))
            digest.update(f32_bits(lps))
        digest.update(struct.pack("<d", loss.item()))
    llm.shutdown()
    return digest.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model directory (default: built-in model)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--check-rerun", action="store_true", help="run twice and compare digests")
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None:
        from detspec.default_model import default_model_dir

        model_dir = str(default_model_dir())
    first = run(model_dir, args.steps, args.group, args.max_tokens, args.lr)
    print(f"digest {first}")
    if args.check_rerun:
        second = run(model_dir, args.steps, args.group, args.max_tokens, args.lr)
        print(f"rerun digest {second}: {'identical' if second == first else 'DIFFERENT'}")
        if second != first:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
