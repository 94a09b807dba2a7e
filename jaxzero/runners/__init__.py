"""What trains a state, behind one protocol (jaxzero.runners.base.Runner): the in-memory
program, the NVMe optimizer tier and ZeRO-Infinity. jaxzero.runners.choose.make_runner
picks one from the config; the training loop and jaxzero.Engine both call it."""
