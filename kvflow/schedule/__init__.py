"""Scheduling policies the engine and the providers use: which rail a tcp
data connection leaves by and how failed ones are rebuilt (rails), and the
one back-off state machine every retry shares (health). QoS and receiver
credits come next, at the native seam between prepare and enqueue."""
