"""The core pi0, pi0.5 and SmolVLA share: flow-matching numerics, masks, image resizing and the joint layers."""
