"""Agents and environments over an inference interface: multi-turn, tool-using episodes the RL
step trains on (inference.py, agent.py, trajectory.py, stage.py; built-in environments: guess.py)."""
