"""Test support shared by the test suite and the benches: a fake cluster of workers that
speak the real protocol with modelled costs (fake_cluster.py), hostile peers for the
protocol's fuzz tests (fuzzing.py), and the fault harness that runs real `flexmarl run`
processes and injects faults into them (faults.py). A running controller never imports it.
"""
