"""The long-answer length workload at another answer cap (issue 40: GRPO with answers up to 2,048 tokens).

    python tools/long_lengths.py ../shared/assets/data/gsm8k/long_lengths.json --cap 2048 \
        -o .assets/long_lengths_2048.json

`data/gsm8k/long_lengths.json` pairs each GSM8K question's prompt length with an answer length drawn from a
log-normal (median 300, sigma 0.7, numpy's default_rng(0), rounded, at least 8, capped at 1,024; see
../shared/assets/README.md). This redraws the same answers with another cap: the same generator and seed give the same
draw, so every answer under 1,024 keeps its length and only the 4.2 % at the cap grow. It first checks that the draw at
cap 1,024 reproduces the file exactly, and refuses otherwise.
"""

import argparse
import json
from pathlib import Path

import numpy as np


def answer_lengths(n: int, cap: int) -> np.ndarray:
    """The asset's draw of n answer lengths, capped at cap."""
    draw = np.random.default_rng(0).lognormal(np.log(300), 0.7, n)
    return np.clip(np.round(draw), 8, cap).astype(int)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lengths", help="data/gsm8k/long_lengths.json")
    parser.add_argument("--cap", type=int, default=2048, help="the longest answer (tokens)")
    parser.add_argument("-o", "--output", required=True, help="the JSON file to write")
    args = parser.parse_args()
    source = json.loads(Path(args.lengths).read_text())
    pairs = np.asarray(source["pairs"])
    if not np.array_equal(answer_lengths(len(pairs), 1024), pairs[:, 1]):
        raise SystemExit(f"{args.lengths}: its answer lengths are not the log-normal draw this tool reproduces")
    pairs[:, 1] = answer_lengths(len(pairs), args.cap)
    source["source"] = source["source"].replace("capped at 1024", f"capped at {args.cap}")
    source["pairs"] = pairs.tolist()
    Path(args.output).write_text(json.dumps(source))
    answers = pairs[:, 1]
    print(
        f"{args.output}: {len(pairs)} pairs, answers median {np.median(answers):.0f}, mean {answers.mean():.0f}, "
        f"{(answers == args.cap).mean():.1%} at the cap {args.cap}"
    )


if __name__ == "__main__":
    main()
