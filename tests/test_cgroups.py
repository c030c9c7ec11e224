"""Where a call's cgroup is made and what is written to it (grpo_jax/cgroups.py), for both cgroup
versions, on hierarchies laid out as the kernel lays them out but made of plain files: the machine
the suite runs on has one of them (tests/test_sandbox.py holds a real call's tree in it)."""

import functools
import os
import shutil

import pytest

from grpo_jax import cgroups


@pytest.fixture
def host(tmp_path, monkeypatch):
  """host(mounts, own): cgroups reads `mounts` ((mount point, the hierarchy's path mounted there,
  'cgroup' or 'cgroup2', its v1 controllers)) as /proc/self/mountinfo and `own` as this process's
  /proc/self/cgroup; the trees' directories are removed as the kernel would (files and all)."""

  mounts_of = cgroups._mounts

  def make(mounts, own):
    lines = [f'{30 + i} 23 0:{26 + i} {root} {point} rw,nosuid - {kind} {kind} rw{"," if options else ""}{options}'
             for i, (point, root, kind, options) in enumerate(mounts)]
    (tmp_path / 'mountinfo').write_text('\n'.join(lines) + '\n')
    monkeypatch.setattr(cgroups, '_mounts', functools.partial(mounts_of, str(tmp_path / 'mountinfo')))
    monkeypatch.setattr(cgroups, '_own', lambda: own)
    monkeypatch.setattr(cgroups, '_remove', lambda directory: shutil.rmtree(directory, ignore_errors=True))

  return make


def test_a_v2_tree_holds_memory_and_processes_in_one_cgroup(tmp_path, host):
  own = tmp_path / 'v2' / 'trainer.scope'
  own.mkdir(parents=True)
  (own / 'cgroup.controllers').write_text('cpu io memory pids\n')
  (own / 'cgroup.subtree_control').write_text('memory pids\n')
  host([(str(tmp_path / 'v2'), '/', 'cgroup2', '')], {'': '/trainer.scope'})
  hierarchy, said = cgroups.find()
  assert hierarchy == cgroups.Hierarchy(2, str(own), str(own))
  assert said == f'a cgroup v2 per call (memory and processes, under {own})'
  tree = cgroups.Tree(hierarchy, 256 << 20, 18)
  [directory] = tree.directories
  assert os.path.dirname(directory) == str(own)
  assert (open(os.path.join(directory, 'memory.max')).read(), open(os.path.join(directory, 'pids.max')).read()) == \
      (str(256 << 20), '18')
  assert tree.enter(['bwrap', '--x'])[-4:] == [os.path.join(directory, 'cgroup.procs'), '--', 'bwrap', '--x']
  assert (tree.peak_bytes(), tree.memory_kills()) == (0, 0)  # a kernel before 5.19 has no memory.peak
  with open(os.path.join(directory, 'memory.events'), 'w') as f:
    f.write('low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n')
  with open(os.path.join(directory, 'memory.peak'), 'w') as f:
    f.write(f'{200 << 20}\n')
  assert (tree.peak_bytes(), tree.memory_kills()) == (200 << 20, 2)
  tree.remove()
  assert not os.path.exists(directory)


def test_v1_when_the_v2_hierarchy_holds_no_memory_controller(tmp_path, host):
  """This machine's layout: v1 hierarchies per controller beside a cgroup2 holding only hugetlb;
  the memory hierarchy mounted from a path of its own (a container's view)."""
  (tmp_path / 'unified').mkdir()
  (tmp_path / 'unified' / 'cgroup.controllers').write_text('hugetlb\n')
  (tmp_path / 'memory' / 'job').mkdir(parents=True)
  (tmp_path / 'pids').mkdir()
  host([(str(tmp_path / 'memory'), '/process_api', 'cgroup', 'memory'),
        (str(tmp_path / 'pids'), '/', 'cgroup', 'pids'),
        (str(tmp_path / 'unified'), '/', 'cgroup2', '')],
       {'memory': '/process_api/job', 'pids': '/', '': '/', 'name=systemd': '/'})
  hierarchy, said = cgroups.find()
  assert hierarchy == cgroups.Hierarchy(1, str(tmp_path / 'memory' / 'job'), str(tmp_path / 'pids'))
  tree = cgroups.Tree(hierarchy, 512 << 20, 10)
  memory, pids = tree.directories
  assert open(os.path.join(memory, 'memory.limit_in_bytes')).read() == str(512 << 20)
  assert open(os.path.join(pids, 'pids.max')).read() == '10'
  assert tree.enter(['true'])[-4:-2] == [os.path.join(memory, 'cgroup.procs'), os.path.join(pids, 'cgroup.procs')]
  with open(os.path.join(memory, 'memory.oom_control'), 'w') as f:
    f.write('oom_kill_disable 0\nunder_oom 0\noom_kill 4\n')
  with open(os.path.join(memory, 'memory.max_usage_in_bytes'), 'w') as f:
    f.write(f'{512 << 20}\n')
  assert (tree.peak_bytes(), tree.memory_kills()) == (512 << 20, 4)


def test_no_cgroup_where_none_may_be_made(tmp_path, host):
  host([(str(tmp_path / 'unified'), '/', 'cgroup2', '')], {'': '/'})
  (tmp_path / 'unified').mkdir()
  (tmp_path / 'unified' / 'cgroup.controllers').write_text('hugetlb\n')
  assert cgroups.find() == (None, 'no cgroup hierarchy here holds the memory controller for this process')
  # The process's own cgroup is outside the part of its hierarchy this mount shows.
  host([(str(tmp_path / 'memory'), '/elsewhere', 'cgroup', 'memory')], {'memory': '/job'})
  assert cgroups.find()[0] is None
