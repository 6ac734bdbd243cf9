"""The parameter channel: one API over every transport that moves an agent's tensors (shm, disk, TCP, CUDA IPC, NCCL, in-process), its bucket format and checksum."""
