"""pi0.5 as LeRobot 0.6.1 builds it (see modeling_pi05)."""
