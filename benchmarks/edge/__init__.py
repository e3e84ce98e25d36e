"""Edge tier benchmarks: through the mesh, in-process, by core count."""
