"""What each step proposes: the RNN drafter and its beam search, context
lookup, the datastore, their prefix tree, and the node budget that prunes it
to what this machine's cost curve makes worth verifying. Below the engine:
nothing here runs the base model."""
