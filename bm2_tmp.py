import time, torch
import spnl_backend.kernels.cpu as cpu
k = cpu.cpu_kernels(); lib = k.library
inner = 10240
gu = torch.randn(1024, 2 * inner); out = torch.empty(1024, inner)
for th in (1, 2, 1, 2):
    f = lambda: lib.spnl_gated_act(1, gu.data_ptr(), gu.data_ptr() + 4 * inner, 1024, inner, 2 * inner, 2 * inner, out.data_ptr(), th)
    f(); ts = []
    for _ in range(8):
        w0 = time.perf_counter(); f(); ts.append((time.perf_counter() - w0) * 1e3)
    print(th, "reused out: best %.1f ms median %.1f" % (min(ts), sorted(ts)[4]))
    w0 = time.perf_counter(); torch.empty(1024, inner).fill_(0); print(" fresh 42MB fill", (time.perf_counter() - w0) * 1e3)
