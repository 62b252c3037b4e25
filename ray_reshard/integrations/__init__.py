"""Trainer-side integrations on top of `ReshardGroup`: Ray Train's `TorchTrainer` refitting live
engines (`ray_train`) and the actor handles of trainer and engine workers (`actors`). Engines'
own backends live in `ray_reshard.engines`."""
