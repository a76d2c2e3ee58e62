"""The library's own threads leave Ctrl-C to the host's main thread."""

import signal


def leave_interrupts_to_the_main_thread() -> None:
    """Block SIGINT in the calling thread, one of the library's own. The kernel hands a
    process-wide signal to any thread that does not block it: handed to a library thread,
    the main thread (where Python raises `KeyboardInterrupt`) went on waiting on a lock
    until that lock was released; blocked here, it reaches the main thread at once. Where
    the platform has no signal masks (Windows) this does nothing."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
