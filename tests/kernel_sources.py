"""Kernel bodies that more than one test runs: tests/test_metal_kernel.py on the CPU path and
tests/msl_cuda/user_kernels.py on an NVIDIA GPU."""

# Every thread attribute of a 3-D dispatchThreads grid, written where the thread can be checked:
# per thread its threadgroup, the threadgroup's size, its linear index (0 when the attributes
# agree) and the threadgroup count.
POSITIONS_SOURCE = """
        uint3 p = thread_position_in_grid;
        uint i = (p.z * threads_per_grid.y + p.y) * threads_per_grid.x + p.x;
        uint3 g = threadgroup_position_in_grid;
        uint3 t = thread_position_in_threadgroup;
        uint3 n = threads_per_threadgroup;
        out[i * 4 + 0] = int(g.x * 100 + g.y * 10 + g.z);
        out[i * 4 + 1] = int(n.x * 100 + n.y * 10 + n.z);
        out[i * 4 + 2] = int((t.z * n.y + t.y) * n.x + t.x) - int(thread_index_in_threadgroup);
        out[i * 4 + 3] = int(threadgroups_per_grid.x * 100 + threadgroups_per_grid.y * 10 +
                             threadgroups_per_grid.z);
    """
