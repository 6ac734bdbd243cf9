"""The web view of a run: every agent's curves, each worker's busy and idle time, and every
episode as its tree of turns across agents, for a finished run or a running one.

    files.py     following the run's files as they grow (JSON lines, the event log)
    agents.py    each agent's curves, from metrics.jsonl
    cluster.py   the workers' busy and idle time and what happened to them (the replay
                 summary's rules, fed the log a part at a time)
    episodes.py  every sample and episode, from the event log and samples.jsonl
    watch.py     the run directory followed as it grows (`RunWatch`)
    server.py    the page and its JSON API (`ViewServer`), loopback unless given a key
    command.py   `flexmarl view RUN_DIR`
    static/      the page, its script and styles, and the charting and table libraries it
                 uses (static/vendor/, with their licences and where they came from)

It reads a run directory and never writes to it; a running controller serves the same
pages (run/experiment.py) and reads its own files only while a page is open.
"""
