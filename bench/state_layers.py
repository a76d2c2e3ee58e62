"""The state layers' recurrences over a prefill: torch's chunked form against the C kernel.

    python bench/state_layers.py [--threads 2] [--tokens 1024] [--piece 32] [--runs 3]
        [--heads 16] [--head-dim 128] [--ssd-heads 48] [--ssd-head-dim 64]
        [--ssd-state 128] [--markdown FILE]

One sequence's prefill of --tokens through one layer's recurrence, as the layer runs it:
in pieces of --piece rows (the block size: pieces end at block boundaries), each piece
through the gated delta rule (a Qwen3.5-like Gated DeltaNet: --heads value heads of
--head-dim key and value dims) or Mamba-2's scan (Granite-like: --ssd-heads heads of
--ssd-head-dim channels, a state of --ssd-state). Each is timed as torch's chunked form
(the torch path's prefill), the same over the whole prompt as one piece (what it would
take without the pieces), and the C kernel (token by token, the CPU's path in float32):
the median of --runs after one untimed run.
"""

from collections.abc import Callable

import harness
import torch
import torch.nn.functional as F

# A form of a recurrence: (its inputs, the state updated in place) → the piece's outputs.
Form = Callable[[tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]
Inputs = tuple[tuple[torch.Tensor, ...], tuple[int, ...]]


def delta_inputs(tokens: int, heads: int, dim: int) -> Inputs:
    """q, k, v, g, beta as the DeltaNet layer hands them over, and the state's shape."""
    q = F.normalize(torch.randn(tokens, heads, dim), dim=-1) * dim**-0.5
    k = F.normalize(torch.randn(tokens, heads, dim), dim=-1)
    v = torch.randn(tokens, heads, dim)
    return (q, k, v, -torch.rand(tokens, heads), torch.rand(tokens, heads)), (heads, dim, dim)


def ssd_inputs(tokens: int, heads: int, dim: int, state: int) -> Inputs:
    """x, dt, a, b, c as the Mamba-2 layer hands them over, and the state's shape."""
    x, dt = torch.randn(tokens, heads, dim), F.softplus(torch.randn(tokens, heads))
    a = -torch.rand(heads) - 0.1
    b, c = torch.randn(tokens, heads, state), torch.randn(tokens, heads, state)
    return (x, dt, a, b, c), (heads, dim, state)


def in_pieces(form: Form, inputs: Inputs, piece: int) -> Callable[[], None]:
    """A call that runs ``form`` over the prompt piece by piece from a zero state (inputs
    of one row per head, Mamba-2's rates, are passed whole)."""
    tensors, shape = inputs
    tokens = len(tensors[0])

    def run() -> None:
        state = torch.zeros(shape)
        for first in range(0, tokens, piece):
            rows = slice(first, first + piece)
            form(tuple(t[rows] if len(t) == tokens else t for t in tensors), state)

    return run


def main() -> None:
    parser = harness.arguments(__doc__, runs=True)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--piece", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ssd-heads", type=int, default=48)
    parser.add_argument("--ssd-head-dim", type=int, default=64)
    parser.add_argument("--ssd-state", type=int, default=128)
    args = parser.parse_args()
    from spnl_backend.kernels import delta_rule, ssd

    native = harness.native_kernels(args.threads)
    recurrences = {
        f"gated delta rule ({args.heads} heads, dk = dv = {args.head_dim})": (
            delta_inputs(args.tokens, args.heads, args.head_dim),
            lambda x, s: delta_rule.chunked(*x, s),
            lambda x, s: native.delta_rule_(*x, s),
        ),
        f"SSD scan ({args.ssd_heads} heads of {args.ssd_head_dim}, state {args.ssd_state})": (
            ssd_inputs(args.tokens, args.ssd_heads, args.ssd_head_dim, args.ssd_state),
            lambda x, s: ssd.chunked(*x, s),
            lambda x, s: native.ssd_scan_(*x, s),
        ),
    }
    rows = []
    for name, (inputs, chunked, kernel) in recurrences.items():
        forms = ((chunked, args.piece), (chunked, args.tokens), (kernel, args.piece))
        times = [
            harness.median_seconds(in_pieces(form, inputs, piece), args.runs, warmup=1)
            for form, piece in forms
        ]
        cells = [f"{t * 1e3:,.1f} ms" for t in times]
        rows.append([name, *cells, f"{times[0] / times[2]:.2f}x"])
    header = [
        "recurrence",
        f"torch chunked, pieces of {args.piece}",
        "torch chunked, one piece",
        f"C kernel, pieces of {args.piece}",
        "C over torch in pieces",
    ]
    note = f"{args.threads} threads; one sequence's {args.tokens:,} tokens; median of {args.runs}."
    harness.publish(f"{harness.md_table(header, rows)}\n\n{note}", args.markdown)


if __name__ == "__main__":
    main()
