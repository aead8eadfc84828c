"""The job seen from outside: status, the page, the live server. Reads the output folder only, never writes job state."""
