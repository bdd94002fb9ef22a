"""Scheduling policies the engine and the providers use: which rail a tcp
data connection leaves by and how failed ones are rebuilt (rails), the one
back-off state machine every retry shares (health), and the transfer QoS
arguments (qos: priority classes and deadlines, which the native scheduler
at the seam between prepare and enqueue orders queued slices by). Receiver
credits come next."""
