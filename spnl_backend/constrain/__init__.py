"""Constrained decoding: what a request may ask its output to match (`spec`), the
matchers that enforce it token by token (`grammar`, on llguidance), and token healing
(`healing`), which constrains a completion's first token to continue a prompt cut short."""
