"""The refill schedule's count at HH-RLHF lengths (docs/benchmarks.md, "Generation that computes only live rows").

Replays generate's schedule on the host, no model: batch 768 drawn as tools/bench_ppo.py draws it (prompts over 256
dropped, answers capped at 256), prompts in order of length, 256 slots, refills of 32 when as many are free, looked
at every 8 decode steps. Counts the prompt positions the refills' prefills compute at prefill_widths(256) against
every prompt at 256, and the cache token slots the decode steps read: every slot's (before) or the live rows' only
(after). Mean of 10 draws. Run from the repository root:

    PYTHONPATH=. python bench/probes/refill-schedule-count-20261206.py ../shared/assets/data/hh-rlhf/hh_lengths.json
"""

import json
import sys

import numpy as np

from jaxrlhf.generate import prefill_widths

PROMPT, SLOTS, REFILL, EVERY, BATCH = 256, 256, 32, 8, 768
WIDTHS = np.array(prefill_widths(PROMPT))


def replay(prompt, answer):
    N = len(prompt)
    row, g, done, nxt = np.full(SLOTS, N), np.zeros(SLOTS, int), np.ones(SLOTS, bool), 0
    read_all = read_live = steps = prefill = 0
    while not done.all() or nxt < N:
        while nxt < N and done.sum() >= min(REFILL, N - nxt):
            k, free = min(REFILL, N - nxt), np.flatnonzero(done)[:REFILL]
            prefill += k * WIDTHS[np.searchsorted(WIDTHS, prompt[nxt : nxt + k].max())]
            row[free[:k]], g[free[:k]], done[free[:k]] = np.arange(nxt, nxt + k), 1, answer[nxt : nxt + k] <= 1
            nxt += k
        for _ in range(EVERY):
            at = np.minimum(row, N - 1)
            context = np.where(row < N, prompt[at] + g, 0)
            read_all, read_live, steps = read_all + context.sum(), read_live + context[~done].sum(), steps + 1
            g = np.where(done, g, g + 1)
            done = done | (g >= answer[at])
    return prompt.sum(), N * PROMPT, prefill, steps, read_all, read_live


with open(sys.argv[1]) as f:
    pairs = [(p, min(a, 256)) for p, a in json.load(f)["pairs"] if p <= PROMPT]
runs = []
for seed in range(10):
    pick = np.random.default_rng(seed).choice(len(pairs), BATCH, replace=False)
    prompt, answer = (np.array([pairs[i][j] for i in pick]) for j in (0, 1))
    order = np.argsort(prompt, kind="stable")
    runs.append(replay(prompt[order], answer[order]))
real, full, bucketed, steps, read_all, read_live = np.mean(runs, axis=0)
print(f"prompt positions: {real:.0f} real, {full:.0f} at full width, {bucketed:.0f} at prefill_widths")
print(f"decode steps {steps:.0f}; cache token slots read: {read_all:.0f} every slot, {read_live:.0f} live rows only")
