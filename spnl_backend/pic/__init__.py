"""Position-independent caching (PIC) of spnl's ``plus`` blocks.

A prompt is a run of ``cross`` and ``plus`` spans (`layout`); consecutive plus spans form
a group whose elements commute: each attends to the cross tokens before its group and to
itself, never to another element, so its K/V depends only on what came before the group
and on its own tokens. Requests say where the spans are in three ways (`requests`); the
paged engine caches each element's blocks under that key (`engine.pic_blocks`).
"""

from .layout import PicLayout, PicPrompt, Span

__all__ = ["PicLayout", "PicPrompt", "Span"]
