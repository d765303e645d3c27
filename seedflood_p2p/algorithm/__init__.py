"""Algorithm: derived directions, the zeroth-order estimator, SubCGE, one step, replay."""
