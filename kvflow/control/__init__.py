"""The control plane: the frames of the control connection (wire), peer
authentication (auth) and the descriptor an engine serves about itself
(descriptor). Nothing here moves data or knows the Engine."""
