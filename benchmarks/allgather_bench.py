"""All-gather throughput between ranks on this machine (gloo on CPU, NCCL with GPUs).

Not run by CI. Run under torchrun; rank 0 prints, for each size, the GB/s each rank receives
((N-1)/N of the gathered tensor per call), the median of --repeat calls. The scaling model in
SCALING.md uses this figure.

    torchrun --nproc-per-node 2 benchmarks/allgather_bench.py [--repeat 9]
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    for mib in (1, 4, 16, 64):
        full = torch.empty(mib << 18, device=device)  # mib MiB of fp32
        shard = torch.ones(full.numel() // world, device=device)
        times = []
        for _ in range(args.repeat):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(full, shard)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        received = full.numel() * 4 * (world - 1) / world
        if rank == 0:
            print(f"{mib:>3} MiB gathered over {world} ranks: {received / statistics.median(times) / 1e9:.2f} GB/s "
                  f"received per rank (median of {args.repeat})", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
