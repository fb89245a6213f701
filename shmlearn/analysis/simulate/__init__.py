"""`shmlearn simulate`: the command (main), the network's alpha-beta fit (comm), one worker's
compute by part (compute) and the predictor of a step at W workers (predict)."""
