"""The job's output folder: every file name in it, its lock, pid and background start, and the journal. Both the job (writer) and the monitor (reader) use it."""
