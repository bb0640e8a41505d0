"""Command line of the standalone rank scripts that harness.launch_ranks starts
(failure_job.py, soak_job.py): --rank, --world and the test's TCPStore."""

import argparse
from datetime import timedelta

import torch.distributed as dist


def parse(parser: argparse.ArgumentParser):
    """(args, store): the script's own arguments plus a client of the test's Store."""
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="host:port of the test's TCPStore")
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), args.world, is_master=False, timeout=timedelta(seconds=60))
    return args, store
