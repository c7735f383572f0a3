"""The `tensorsmith` command line (click). No logic of its own: each command calls one library function."""

import os

# numpy advises the kernel to back every large array with transparent huge pages; under Linux's default THP
# defrag setting ("madvise") the first touch of such an array may then stall in direct compaction, on a machine
# whose free memory is fragmented by its page cache: a fresh 1 GB array took 10.9 s to fill here, 0.35 s without
# the advice (docs/benchmark-history.md). A compile's arrays are written once and dropped: huge pages win nothing back.
# Set before numpy is imported (it reads this once); a user's own setting is kept.
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")
