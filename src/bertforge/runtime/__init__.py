"""Where programs run: devices and the mesh, XLA options, the allocator, the compile cache."""
