"""A small rustc10d job: all_reduce, broadcast, send/recv and barrier on CPU tensors.

    torchrun --nproc-per-node 2 examples/allreduce_demo.py

Each rank prints what it got; rank 0 prints "OK" when every rank got the expected values, and
the job exits non-zero otherwise. `--backend gloo` runs the same job on Gloo for comparison.
"""

import argparse
import sys

import torch
import torch.distributed as dist


def say(line: str):
    # one write per line: ranks share torchrun's (unbuffered) stdout
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="rustc10d")
    args = parser.parse_args()
    if args.backend == "rustc10d":
        import rustc10d  # noqa: F401  (registers the "rustc10d" backend with torch.distributed)

    # torchrun provides RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        print("run with at least 2 processes, e.g. torchrun --nproc-per-node 2", file=sys.stderr)
        return 2
    errors = []

    # all_reduce: every rank contributes rank + 1
    total = torch.full((4,), float(rank + 1))
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    if total.tolist() != [world * (world + 1) / 2] * 4:
        errors.append(f"all_reduce gave {total.tolist()}")

    # broadcast from the last rank
    root = world - 1
    data = torch.arange(5) * 10 if rank == root else torch.zeros(5, dtype=torch.int64)
    dist.broadcast(data, src=root)
    if data.tolist() != [0, 10, 20, 30, 40]:
        errors.append(f"broadcast gave {data.tolist()}")

    # send/recv around a ring: each rank sends its rank to the next one
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    send = dist.isend(torch.tensor([rank]), dst=nxt)
    got = torch.tensor([-1])
    dist.recv(got, src=prv)
    send.wait()
    if got.item() != prv:
        errors.append(f"recv from rank {prv} gave {got.item()}")

    dist.barrier()
    say(f"[rank {rank}] all_reduce={total.tolist()} broadcast={data.tolist()} "
        f"recv from {prv}={got.item()} {'errors: ' + '; '.join(errors) if errors else 'ok'}")

    # every rank learns whether all ranks were right
    all_ok = torch.tensor([0 if errors else 1])
    dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    if all_ok.item() != 1:
        return 1
    if rank == 0:
        say("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
