"""Runtime: what runs a compiled program, in four wings (planning, communication, execution, and
program: the runtime plan and the written program). The modules generated stage code and a
written program.py import stay here, at fixed paths, so that programs written before keep
loading: stage (StageModule, checkpoint), comm (MicrobatchComm), ops, launch."""
