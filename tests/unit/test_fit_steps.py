"""fit's ``steps_per_epoch`` with in-memory arrays (issue 30): the epochs Keras 3 runs, and the ones nbdist
refuses in one sentence because they are not all alike (checked before any worker starts)."""
from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

from nbdist.driver.fit_call import check_fit_arguments, keras_epoch_steps, uniform_epoch_steps
from nbdist.errors import NbdistError
from nbdist.fit_arguments import FitCall


def keras_own_epochs(rows: int, batch: int, steps_per_epoch: int, epochs: int) -> list[int]:
    """The steps Keras' own EpochIterator gives each epoch of a fit on arrays (one iterator for the fit)."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    iterator = EpochIterator(np.arange(rows, dtype="float32")[:, None], np.zeros(rows, "float32"),
                             batch_size=batch, steps_per_epoch=steps_per_epoch, shuffle=False)
    iterator.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Your input ran out of data": the epochs Keras cuts short
        return [sum(1 for _ in iterator.enumerate_epoch()) for _ in range(epochs)]


@pytest.mark.parametrize("rows, batch", [(10, 3), (12, 3), (64, 16), (70, 16)])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 7])
def test_epoch_steps_are_keras_own(rows, batch, steps):
    batches = -(-rows // batch)
    assert keras_epoch_steps(batches, steps, 7) == keras_own_epochs(rows, batch, steps, 7)


def test_alike_epochs_run_and_the_others_are_refused_in_one_sentence():
    assert uniform_epoch_steps(384, 64, 2, 4) == 2  # 6 batches: 2, 2, 2, 2 (the data starts over)
    assert uniform_epoch_steps(384, 64, 6, 4) is None  # a pass per epoch: as without steps_per_epoch
    assert uniform_epoch_steps(384, 64, 9, 4) is None  # Keras cuts every epoch at the pass's end
    assert uniform_epoch_steps(400, 64, 2, 3) == 2  # 7 batches, the short 7th never read
    with pytest.raises(NbdistError) as uneven:
        uniform_epoch_steps(384, 64, 4, 3)  # 4, 2, 4: Keras cuts the 2nd epoch short
    with pytest.raises(NbdistError) as short:
        uniform_epoch_steps(468, 64, 4, 2)  # 8 batches: the 8th (20 rows) ends the 2nd epoch, not the 1st
    for info in (uneven, short):
        message = str(info.value)
        assert "steps_per_epoch=" in message and message.count(". ") == 0 and message.endswith(".")
    assert "4, 2, 4" in str(uneven.value) and "divides 6" in str(uneven.value)
    assert "multiple of 64" in str(short.value)


@pytest.mark.parametrize("name, value", [("steps_per_epoch", 0), ("validation_steps", 1.5),
                                         ("steps_per_epoch", True)])
def test_bad_step_counts_are_one_sentence(name, value):
    fit = FitCall(x=np.zeros((8, 2)), epochs=1, initial_epoch=0, **{name: value})
    with pytest.raises(NbdistError, match=name):
        check_fit_arguments(fit)


@pytest.mark.parametrize("callback", [lambda d: keras.callbacks.BackupAndRestore(d, save_freq=10),
                                      lambda d: keras.callbacks.ModelCheckpoint(d + "/m.keras", save_freq=5)])
def test_callbacks_saving_every_n_batches_are_refused(tmp_path, callback):
    """Their batch hooks would never run (the batches run on the workers): one sentence, not no backup."""
    cb = callback(str(tmp_path))
    fit = FitCall(x=np.zeros((8, 2)), epochs=1, initial_epoch=0, callbacks=[cb])
    with pytest.raises(NbdistError) as info:
        check_fit_arguments(fit)
    message = str(info.value)
    assert f"{type(cb).__name__}(save_freq=" in message and "save_freq='epoch'" in message
    assert message.count(". ") == 0


def test_where_a_relaunch_starts_reading_and_what_validation_reads():
    """A relaunch after a failure (--max-restarts) at epoch e reads from where the uninterrupted fit would
    have: pass and batch counted from the epoch the fit's data started; validation_steps: the first rows."""
    from nbdist.driver.callbacks import DriverCallbacks
    from nbdist.driver.fit_call import FitRun

    run = FitRun(DriverCallbacks(None, [], 4), rows=384, global_batch=64, epochs=4, steps_per_epoch=2,
                 validation_steps=2)
    assert run.worker_steps(2, 32) == 2
    assert [run.data_start(e, 0, 2, 6) for e in range(5)] == [(0, 0), (0, 2), (0, 4), (1, 0), (1, 2)]
    assert run.data_start(3, 3, 2, 6) == (3, 0)  # a new fit call (BackupAndRestore's rerun): from the start
    assert run.data_start(3, 0, None, 6) == (3, 0)  # without steps_per_epoch an epoch is a pass
    assert run.validation_rows(200, 2, 32) == 128 and run.validation_rows(100, 2, 32) == 100
    sized = FitRun(DriverCallbacks(None, [], 4), validation_steps=2, validation_batch=10)  # validation_batch_size
    assert sized.validation_rows(200, 2, 32) == 20


def keras_own_py_dataset_epochs(batches: int, steps_per_epoch: int, epochs: int) -> list[int]:
    """The steps Keras' own EpochIterator gives each epoch of a fit on a PyDataset of ``batches`` batches."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return batches

        def __getitem__(self, i):
            return np.full((2, 1), i, "float32"), np.zeros(2, "float32")

    iterator = EpochIterator(Batches(), steps_per_epoch=steps_per_epoch, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [sum(1 for _ in iterator.enumerate_epoch()) for _ in range(epochs)]


@pytest.mark.parametrize("batches, steps", [(18, 6), (18, 18), (18, 25), (19, 18), (10, 4)])
def test_a_py_datasets_epochs_are_keras_own_and_each_reads_its_part_of_a_pass(batches, steps):
    """Under steps_per_epoch a PyDataset's epochs are Keras' (alike, or refused in one sentence), and epoch after
    epoch the parts read (``epoch_window``) tile the passes, from where a relaunch starts (``data_start``)."""
    from nbdist.data.sharding import epoch_window
    from nbdist.driver.callbacks import DriverCallbacks
    from nbdist.driver.fit_call import FitRun

    epochs = 5
    assert keras_epoch_steps(batches, steps, epochs) == keras_own_py_dataset_epochs(batches, steps, epochs)
    run = FitRun(DriverCallbacks(None, [], epochs), epochs=epochs, steps_per_epoch=steps)
    if len(set(keras_epoch_steps(batches, steps, epochs))) > 1:
        with pytest.raises(NbdistError, match=f"does not divide the PyDataset's {batches} batches"):
            run.py_dataset_steps(batches)
        return
    per_epoch = run.py_dataset_steps(batches)
    windows = [epoch_window(batches, per_epoch, 0, 0, e) for e in range(epochs)]
    if per_epoch is None:
        assert steps >= batches and windows == [(e, 0, batches) for e in range(epochs)]
        return
    read = [(p, i) for p, a, b in windows for i in range(a, b)]
    assert read == [divmod(k, batches) for k in range(epochs * per_epoch)]  # pass after pass, nothing skipped
    for start in range(1, epochs):  # a relaunch at epoch `start` reads what the uninterrupted fit would
        first_pass, first_batch = run.data_start(start, 0, per_epoch, batches)
        again = [epoch_window(batches, per_epoch, first_pass, first_batch, e - start) for e in range(start, epochs)]
        assert again == windows[start:]


def test_validation_steps_beside_a_py_dataset_reads_keras_default_batches():
    from nbdist.driver.callbacks import DriverCallbacks
    from nbdist.driver.fit_call import FitRun

    run = FitRun(DriverCallbacks(None, [], 2), validation_steps=3)
    assert run.validation_rows(200, 2, None) == 96  # Keras' evaluate: batches of 32 when fit gave none
