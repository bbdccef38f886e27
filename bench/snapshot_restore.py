"""A restore's writing of a packed snapshot into a rank's tensors: from pageable memory directly,
through two page-locked staging buffers, and (on a GPU) from page-locked memory.

The state is a trained role's at a gsm8k workload's shapes (``--layers`` of its blocks and its
embedding): each parameter fp32, its two AdamW moments and its step count, packed as a snapshot
packs them (``resilient_rl/workers/snapshots/buffers.py``). A process that replaces a killed rank
restores the copy the rank left in node memory, which it maps pageable; a copy from the object
store or a peer is pageable too. The ways, each timed ``--repeat`` times in turn (best printed),
with their rate and ratio to the direct copy:

- ``direct``: one ``copy_`` per tensor from the pageable buffer (before ``staged.py``);
- ``staged``: the same buffer through two page-locked buffers (``staged.py``; what a restore into
  GPU tensors now does);
- ``pinned``: the buffer page-locked itself, the path of the rank's own copy (GPU only).

On a CPU the destinations are host tensors and nothing is page-locked: a check of the script (the
staging's extra host copy makes it slower there; a restore stages only into GPU tensors).

    python bench/snapshot_restore.py --device cuda
    python bench/snapshot_restore.py --layers 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from decode_bench import best_of  # noqa: E402
from gpu_workloads import WORKLOADS  # noqa: E402
from optimizer import parameter_shapes  # noqa: E402

from resilient_rl.page_lock import pinned_host_buffer  # noqa: E402
from resilient_rl.workers.snapshots.buffers import Layout, copy_in  # noqa: E402
from resilient_rl.workers.snapshots.staged import bytes_of  # noqa: E402


def rank_state(shapes, device: str) -> list[tuple[str, torch.Tensor]]:
    """Named tensors as a trained rank holds them: each parameter, its moments and its step."""
    out = []
    for i, shape in enumerate(shapes):
        p = torch.empty(shape, device=device)
        out += [(f"model/p{i}", p), (f"optim/p{i}/exp_avg", torch.empty_like(p)),
                (f"optim/p{i}/exp_avg_sq", torch.empty_like(p)), (f"optim/p{i}/step", torch.zeros((), device=device))]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsm8k-0.5b")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the workload's on a GPU, 2 on a CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the workload's tiny dimensions (a check of the script)")
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload].tiny() if args.tiny else WORKLOADS[args.workload]
    hf = w.hf_config
    layers = args.layers or (hf["num_hidden_layers"] if args.device.startswith("cuda") else 2)
    tensors = rank_state(parameter_shapes(hf, layers), args.device)
    layout = Layout.of(tensors)
    # Random bytes, every page touched; drawn as int64, 8 bytes a draw (400 MiB: 1.14 s against 2.11 s
    # drawn byte by byte on the 2-core development machine).
    words = np.empty(-(-layout.total // 8), dtype=np.int64)
    torch.from_numpy(words).random_(generator=torch.Generator().manual_seed(0))
    data = words.view(np.uint8)[:layout.total]
    gb = layout.total / 1e9
    print(f"restore of {gb:.2f} GB ({len(tensors)} tensors: {w.name}, {layers} blocks, fp32 weights, "
          f"AdamW state) into {args.device} tensors, best of {args.repeat}")
    ways = {"direct": lambda: copy_in(layout, data, tensors, staged=False),
            "staged": lambda: copy_in(layout, data, tensors, staged=True)}
    if args.device.startswith("cuda"):
        # Page-locked at its exact size as a rank's ring is (pinned_host_buffer: torch's pinned
        # allocator would round 5.9 GB up to 8 GiB).
        pinned, unlock = pinned_host_buffer(layout.total)
        pinned.copy_(torch.from_numpy(data))
        if unlock is None:
            print("  (CUDA refused to page-lock the buffer: the pinned way reads pageable memory)")
        ways["pinned"] = lambda: copy_in(layout, pinned.numpy(), tensors, staged=False)
    best: dict[str, float] = {}
    for _ in range(2):  # in turn, so that a noisy neighbour slows every way
        for name, fn in ways.items():
            best[name] = min(best.get(name, float("inf")), best_of(fn, args.repeat))
    copy_in(layout, data, tensors, staged=True)
    check = Layout.of(tensors).views(torch.from_numpy(data))
    same = all(torch.equal(bytes_of(a), bytes_of(t.cpu())) for a, (_, t) in zip(check, tensors))  # random bytes: NaNs
    for name, seconds in best.items():
        print(f"  {name:<7} {seconds:8.3f} s  {gb / seconds:6.1f} GB/s  {seconds / best['direct']:.2f}x")
    print(f"  the staged copy wrote every tensor bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
