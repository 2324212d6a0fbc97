"""Looking inside SPEED: the dense reference, the layer-wise diagnostic, the cutoff sweep
behind `choose-lcut`, and FastKV's TSP-layer calibration."""
