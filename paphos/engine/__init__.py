"""Engine: the step loop (sync for offline use, async for the server) and output processing."""
