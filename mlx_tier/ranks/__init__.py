"""One job over several ranks (processes or Macs): launcher, worker, their files, work stealing, the merged report."""
