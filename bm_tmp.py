import time, torch, dataclasses
import torch.nn.functional as F
import spnl_backend.kernels.cpu as cpu
k = cpu.cpu_kernels()
inner = 10240
gu = torch.randn(1024, 2 * inner); g, u = gu[:, :inner], gu[:, inner:]
for th in (1, 2):
    kk = dataclasses.replace(k, threads=th); torch.set_num_threads(th)
    for name, f in (("C gelu", lambda: kk.gated_act("gelu_tanh", g, u)), ("torch gelu", lambda: F.gelu(g, approximate="tanh").mul_(u))):
        f(); ts = []
        for _ in range(8):
            t0 = time.thread_time(); w0 = time.perf_counter(); f(); ts.append((time.perf_counter() - w0) * 1e3)
        print(th, name, "best %.1f ms median %.1f" % (min(ts), sorted(ts)[4]))
