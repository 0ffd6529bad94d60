"""Memory a process hands over or gives back.

- shm         shared-memory slots: the segments, their layout, the writer (a seqlock), sweeping dead owners'
- shm_reader  the reader of slots: descriptors checked before mapping, views checked after reading
- allocator   the C heap's free pages handed back to the kernel between steps (malloc_trim)
"""
