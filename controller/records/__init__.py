"""What records a run and reads it back: metrics and trackers, sample texts, progress, lineage, `flexmarl replay` and its re-drive, a full disk told."""
