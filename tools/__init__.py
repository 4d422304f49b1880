"""infinity.tools: the command-line tools (`nvme-bench`, `swap-inspect`)."""
