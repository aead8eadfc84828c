"""The overnight job: documents in, summaries out; scheduling, batched generation, journal-backed resume, throttle."""
