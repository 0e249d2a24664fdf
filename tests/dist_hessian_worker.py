"""Run under torchrun (2 processes, gloo) by tests/test_distributed_quantize.py: the Hessians each
rank gathers for every block and group (``sequential="sublayer"``: 2 collections per block) are
bit-identical to a single process's; prints one JSON line from rank 0.

It also reports how far a plain reduction (each rank's own running mean, then the token-weighted
sum of the two, what an all_reduce(SUM) of n·H gives) lands from the single-process Hessian:
the rounding the ordered fold avoids.
"""

from __future__ import annotations

import json
import math

import torch

from layercut.calibrate.capture import run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.core.distributed import process_group
from layercut.compress.quant.solve.driver import SEQUENTIAL, HessianSet
from tests.conftest import VOCAB, build_tiny_model

SAMPLES, SEQ_LEN, BATCH = 9, 32, 2


def collect(model, calib: CalibSet, group=None, rounds: int = 0) -> list[tuple[torch.Tensor, int]]:
    out: list[tuple[torch.Tensor, int]] = []

    def on_block(run) -> None:
        for stage in SEQUENTIAL["sublayer"]:
            hs = HessianSet(run, stage, group, rounds)
            hs.collect()
            out.extend((hs.H[g], hs.n[g]) for g in stage)

    run_blocks(model, calib, [on_block], batch_size=BATCH, progress=False)
    return out


def main() -> None:
    model = build_tiny_model("llama")
    gen = torch.Generator().manual_seed(0)
    calib = CalibSet(torch.randint(4, VOCAB, (SAMPLES, SEQ_LEN), generator=gen),
                     torch.ones(SAMPLES, SEQ_LEN, dtype=torch.long))
    calib.attention_mask[-1, -5:] = 0  # a padded tail: token counts differ per micro-batch
    with process_group(torch.device("cpu")) as group:
        rows = group.shard_rows(SAMPLES, BATCH)
        mine = CalibSet(calib.input_ids[rows], calib.attention_mask[rows])
        shared = collect(model, mine, group, group.rounds(math.ceil(SAMPLES / BATCH)))
        single = collect(model, calib)
        local = collect(model, mine)  # this rank's own running means, for the plain-reduction comparison
        worst = 0.0
        for (h1, n1), (hl, nl) in zip(single, local):
            parts = torch.stack(group.all_gather(hl * nl)).sum(0) / n1  # n·H summed over ranks
            worst = max(worst, float((parts - h1).abs().max() / h1.abs().max()))
        if group.rank == 0:
            print(json.dumps({"hessians": len(single), "identical": all(
                torch.equal(a, b) and na == nb for (a, na), (b, nb) in zip(shared, single)),
                "plain_reduction_max_rel_diff": worst}))


if __name__ == "__main__":
    main()
