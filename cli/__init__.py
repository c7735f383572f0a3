"""The `tensorsmith` command line (click). No logic of its own: each command calls one library function."""
