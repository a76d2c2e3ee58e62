"""One model over several processes (`settings.topology` decides how many): tensor
parallelism on torch.distributed (gloo on the CPU, NCCL between GPUs). `driver` is a
machine's first rank, `worker` every other; `group` their collectives, `sharding` each
rank's share of the weights, `tensor_parallel` a rank joining the group and the messages
by which rank 0 has the others run each step with it, `launch` the processes a first
rank starts."""
