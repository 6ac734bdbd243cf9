"""A run, whole: the wiring root (components), the training driver, `Experiment`, `flexmarl serve`, model resolution and the checks made before any worker starts."""
