"""infinity.tools: the command-line tools (`nvme-bench`, `swap-inspect`, `infinity-estimate`,
`infinity-consolidate`, and the training demo `python -m infinity.tools.demo`).

The top layer: tools import `infinity`, `infinity.swap` and `infinity.aio`, and nothing below
imports a tool. What the tools share (BadInput, Progress) is in `_cli`.
"""
