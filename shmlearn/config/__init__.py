"""The run's configuration: TrainConfig and the sections it is built from, the flags generated from
their fields, YAML in and out, and the whole-number limits shared with the strategies."""
